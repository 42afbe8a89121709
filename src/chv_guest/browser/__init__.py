"""chv-browser: accessibility snapshots and screenshots for chv.fleet cells, via Playwright on Debian's chromium."""
