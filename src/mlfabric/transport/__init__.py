"""Moving frames between processes: the authenticating listener every server,
replica, controller and aggregator accepts peers on (`listener`), and the
login that opens a connection to an agent (`agent_login`)."""
