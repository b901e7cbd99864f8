#!/usr/bin/env bash
# Sets up every worker of the TPU VM: copies the working tree there (as sync.sh does), installs
# Python (PSPEC_TPU_PYTHON) and tmux with apt, and makes a venv in the project directory with
# the project and its `tpu` extra in editable mode, plus the asset packages of the Makefile's
# ASSETS (with --no-deps, as `make setup` does). Run it once after create.sh.
#
# Usage: tpu_scripts/setup.sh [--dry-run]
#
#   --dry-run   print the commands instead of running them
#   -h, --help  this text
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

parse_args "$@"
no_args
check_settings

# One list of asset packages: the Makefile's.
assets=''
while IFS= read -r line; do
  [[ $line == 'ASSETS := '* ]] && assets=${line#'ASSETS := '}
done <"$ROOT/Makefile"
[[ -n $assets ]] || die "no 'ASSETS := ...' line in $ROOT/Makefile"

sync_tree
python=$(quote "$PSPEC_TPU_PYTHON")
apt='sudo apt-get -q -o DPkg::Lock::Timeout=600'  # first boot: unattended upgrades hold the lock
on_workers all "$apt update && $apt install -y $python $python-venv tmux && \
cd $(quote "$PSPEC_TPU_DIR") && $python -m venv .venv && .venv/bin/pip install -q --upgrade pip \
&& .venv/bin/pip install -q -e \".[tpu]\" && .venv/bin/pip install -q --no-deps $assets"
