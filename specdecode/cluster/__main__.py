import sys

from specdecode.cluster.cli import main

sys.exit(main())
