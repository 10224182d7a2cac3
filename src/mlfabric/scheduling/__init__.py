"""The controller's decisions, without I/O: the network picture and plan types
(`plan`), the shortest-transfer-first planner (`schedule`), the policies built
on it (`policies`) and in-network aggregation routing (`aggregation`)."""
