"""Moving frames between processes: the authenticating listener every server,
replica, controller and aggregator accepts peers on (`listener`)."""
