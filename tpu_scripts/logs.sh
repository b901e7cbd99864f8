#!/usr/bin/env bash
# Follows the log of the session launch.sh started (~/pspec_logs/SESSION.log) on one worker;
# Ctrl-C stops following, not the job.
#
# Usage: tpu_scripts/logs.sh [--dry-run] [--worker=N|all] [--lines=N]
#
#   --worker=N  the worker whose log to follow: a number, or all (default 0)
#   --lines=N   lines of history to show first (default 100)
#   --dry-run   print the gcloud command instead of running it
#   -h, --help  this text
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

worker=0
lines=100
option() {
  case $1 in
    --worker=*) worker=${1#*=} ;;
    --lines=*) lines=${1#*=} ;;
    *) return 1 ;;
  esac
}
parse_args "$@"
no_args
[[ $worker =~ ^([0-9]+|all)$ ]] || die "--worker must be a number or all, got '$worker'"
[[ $lines =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$lines'"
check_settings

on_workers "$worker" "tail -n $lines -F $LOG_DIR/$PSPEC_TPU_SESSION.log"
