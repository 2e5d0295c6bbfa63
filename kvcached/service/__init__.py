"""The I/O around the pure ledger: the journal service, the live socket view and ``kvctl``.

``kvcached.ledger`` stays pure (msgspec and the standard library). What runs an event loop,
opens sockets or talks to an operator lives here: ``ledger_service`` drains the recorder's
hand-off into the journal on an anyio loop in a background thread and keeps a ledger replica;
``live`` answers ``kvctl`` on a Unix socket from that replica; ``messages`` holds the wire
types both of them and ``kvctl`` speak, so that the service and the live view depend on those
types and not on each other.
"""
