"""Making the engines follow the record, on the request path and in the background loops alike:
a reservation an engine runs ends only once the engine has stopped it (termination.py), and
LMCache's CPU tier holds each tenant's quota, pins and sessions as the ledger says
(cpu_tier_mirror.py)."""
