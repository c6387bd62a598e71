# Sourced by the peer setup scripts. peer_venv DIR [--upgrade-pip] creates the virtual environment DIR
# with $PYTHON (default python3), or reuses it, and sets PY to its interpreter.
peer_venv() {
    VENV="$1"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "creating $VENV"
        "${PYTHON:-python3}" -m venv "$VENV"
        if [ "${2:-}" = "--upgrade-pip" ]; then
            "$VENV/bin/python" -m pip install --quiet --upgrade pip
        fi
    else
        echo "reusing $VENV"
    fi
    PY="$VENV/bin/python"
}
