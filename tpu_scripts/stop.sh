#!/usr/bin/env bash
# Stops the job launch.sh started: kills its tmux session (PSPEC_TPU_SESSION) on every worker.
# A worker where the session already ended says so and is skipped.
#
# Usage: tpu_scripts/stop.sh [--dry-run]
#
#   --dry-run   print the gcloud command instead of running it
#   -h, --help  this text
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

parse_args "$@"
no_args
check_settings

on_workers all "tmux kill-session -t $PSPEC_TPU_SESSION || true"
