import os
import sys

# The cluster's processes are started while gRPC's threads run; its fork handlers only warn.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from stress.run import main

sys.exit(main())
