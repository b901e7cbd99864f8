#!/usr/bin/env bash
# Copies the working tree to every worker of the TPU VM (into PSPEC_TPU_DIR under the home
# directory), leaving out .git, .venv, data, workdirs, bench_results and caches. The install is
# editable, so code changes need only this; files deleted here stay on the workers.
#
# Usage: tpu_scripts/sync.sh [--dry-run]
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
sync_tree
