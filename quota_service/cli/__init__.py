"""The `kvquota` command: one module per command or group of commands (`parser.py` puts them
together), over two shared ones: `connection.py` (reaching a server or the database) and
`formatting.py` (tables, JSON, sizes).

A command imports the server, the store or the gateways inside its run function, so that a
command over gRPC starts without loading SQLAlchemy or the server."""

from quota_service.cli.parser import main

__all__ = ["main"]
