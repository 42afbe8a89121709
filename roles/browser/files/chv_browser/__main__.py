import sys

from chv_browser.server import main

sys.exit(main())
