#!/usr/bin/env bash
# Deletes the TPU VM (or, with PSPEC_TPU_QUEUED=1, its queued resource and the VM with it).
# gcloud asks for confirmation unless --yes is given.
#
# Usage: tpu_scripts/delete.sh [--dry-run] [-y|--yes|--quiet]
#
#   -y, --yes, --quiet  delete without asking
#   --dry-run           print the gcloud command instead of running it
#   -h, --help          this text
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

quiet=()
option() {
  case $1 in
    -y | --yes | --quiet) quiet=(--quiet) ;;
    *) return 1 ;;
  esac
}
parse_args "$@"
no_args
check_settings
tpu_flags

if ((PSPEC_TPU_QUEUED)); then
  # --force: delete the queued resource even though its TPU VM exists (deleting that too).
  run gcloud compute tpus queued-resources delete "$PSPEC_TPU_NAME" "${TPU_FLAGS[@]}" --force \
    "${quiet[@]}"
else
  run gcloud compute tpus tpu-vm delete "$PSPEC_TPU_NAME" "${TPU_FLAGS[@]}" "${quiet[@]}"
fi
