"""gRPC servicers, the error model on the wire, health and reflection."""
