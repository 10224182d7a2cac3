"""What every mlfabric process runs on: the event loop (`loop`: uvloop or
asyncio, bounded waits) and its Prometheus metrics (`metrics`)."""
