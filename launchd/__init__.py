"""launchd services for Sanctum on macOS: plist generation and checks (`plists.py`).

The committed `*.plist` files beside this module are templates rendered by it
with placeholder paths; `deploy/install.sh` renders the real ones.
"""
