import sys

from chv_broker.server import main

sys.exit(main())
