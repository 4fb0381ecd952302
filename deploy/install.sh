#!/bin/sh
# Install Sanctum's launchd services (seatd and proxyd) for the current user,
# or remove them.  launchd keeps the two daemons up; seatd watches the seats.
#
#   deploy/install.sh [--config FILE] [--venv DIR] [--set KEY=VALUE]... [--dry-run]
#   deploy/install.sh --uninstall [--dry-run]
#
# --dry-run prints every command and every file it would write, and changes
# nothing; it works on any platform.  Uses launchctl bootstrap/bootout/kickstart
# (load/unload are deprecated).  The plists are rendered and checked by
# launchd/plists.py, and linted with plutil where it exists.
set -eu
cd "$(dirname "$0")/.."
REPO=$(pwd)

DRY=0
UNINSTALL=0
CONFIG=""
VENV=.venv
SETS=""
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
    --dry-run) DRY=1 ;;
    --uninstall) UNINSTALL=1 ;;
    --config) [ $# -ge 2 ] || usage; CONFIG=$2; shift ;;
    --venv) [ $# -ge 2 ] || usage; VENV=$2; shift ;;
    --set) [ $# -ge 2 ] || usage; SETS="$SETS --set $2"; shift ;;
    -h|--help) usage ;;
    *) echo "install: unknown option $1" >&2; usage ;;
    esac
    shift
done

if [ "$DRY" = 0 ] && [ "$(uname -s)" != Darwin ]; then
    echo "install: launchd exists only on macOS; --dry-run shows what would be done" >&2
    exit 1
fi

DOMAIN="gui/$(id -u)"
PLIST_DIR="$HOME/Library/LaunchAgents"
LOGS="$HOME/Library/Logs/Sanctum"

# Run a command, or only print it under --dry-run.
run() {
    if [ "$DRY" = 1 ]; then
        echo "+ $*"
    else
        "$@"
    fi
}

# A command whose failure is expected (the service was not loaded).
maybe() {
    if [ "$DRY" = 1 ]; then
        echo "+ $* || true"
    else
        "$@" 2>/dev/null || true
    fi
}

if [ "$UNINSTALL" = 1 ]; then
    # proxyd first: stop taking requests, then let seatd drain the seats.
    for svc in proxyd seatd; do
        maybe launchctl bootout "$DOMAIN/com.sanctum.$svc"
        run rm -f "$PLIST_DIR/com.sanctum.$svc.plist"
    done
    echo "install: removed the Sanctum services (logs stay in $LOGS)"
    exit 0
fi

VENV_ABS=$(cd "$VENV" 2>/dev/null && pwd || echo "$REPO/$VENV")
SANCTUM="$VENV_ABS/bin/sanctum"
PY="$VENV_ABS/bin/python"
if [ ! -x "$PY" ]; then
    if [ "$DRY" = 0 ]; then
        echo "install: no virtual environment at $VENV_ABS; run 'make setup' first" >&2
        exit 1
    fi
    PY=python3
fi
CONFIG_ARG=""
if [ -n "$CONFIG" ]; then
    [ -f "$CONFIG" ] || { echo "install: no config file $CONFIG" >&2; exit 1; }
    CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
    CONFIG_ARG="--config $CONFIG"
    # A config that does not validate must not reach launchd.
    run "$SANCTUM" check --config "$CONFIG"
fi

run mkdir -p "$PLIST_DIR" "$LOGS"
# seatd first, so the seats are loading when proxyd starts answering.
for svc in seatd proxyd; do
    label="com.sanctum.$svc"
    plist="$PLIST_DIR/$label.plist"
    # shellcheck disable=SC2086  # CONFIG_ARG and SETS are lists of words
    content=$("$PY" -m launchd.plists render "$svc" --sanctum "$SANCTUM" --home "$HOME" \
        $CONFIG_ARG $SETS)
    if [ "$DRY" = 1 ]; then
        echo "+ write $plist"
        printf '%s\n' "$content"
    else
        printf '%s\n' "$content" >"$plist.tmp"
        mv "$plist.tmp" "$plist"
    fi
    # shellcheck disable=SC2086
    run "$PY" -m launchd.plists check "$plist" $CONFIG_ARG
    if command -v plutil >/dev/null 2>&1; then
        run plutil -lint "$plist"
    fi
    # Replace a running instance: bootout (if loaded), enable, bootstrap, kickstart.
    maybe launchctl bootout "$DOMAIN/$label"
    run launchctl enable "$DOMAIN/$label"
    run launchctl bootstrap "$DOMAIN" "$plist"
    run launchctl kickstart "$DOMAIN/$label"
done
echo "install: seatd and proxyd run under launchd ($DOMAIN); logs in $LOGS"
echo "install: 'sanctum status' shows the seats"
