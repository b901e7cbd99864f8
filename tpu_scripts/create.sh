#!/usr/bin/env bash
# Creates the TPU VM named in settings.sh (or, with PSPEC_TPU_QUEUED=1, a queued resource that
# creates it when capacity is free).
#
# Usage: tpu_scripts/create.sh [--dry-run] [-- GCLOUD_FLAGS...]
#
#   --dry-run   print the gcloud command instead of running it
#   -h, --help  this text
#
# Flags after `--` are passed to gcloud as they are (e.g. --network=NAME, --reserved).
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here != "${BASH_SOURCE[0]}" ]] || here=.
# shellcheck source=tpu_scripts/common.sh
source "$here/common.sh"

parse_args "$@"
check_settings
tpu_flags
spot=()
((PSPEC_TPU_SPOT)) && spot=(--spot)

if ((PSPEC_TPU_QUEUED)); then
  run gcloud compute tpus queued-resources create "$PSPEC_TPU_NAME" "${TPU_FLAGS[@]}" \
    "--node-id=$PSPEC_TPU_NAME" "--accelerator-type=$PSPEC_TPU_TYPE" \
    "--runtime-version=$PSPEC_TPU_RUNTIME" "${spot[@]}" "${ARGS[@]}"
  echo "Queued. Once 'gcloud compute tpus queued-resources describe $PSPEC_TPU_NAME' shows" \
    "state ACTIVE, run tpu_scripts/setup.sh." >&2
else
  run gcloud compute tpus tpu-vm create "$PSPEC_TPU_NAME" "${TPU_FLAGS[@]}" \
    "--accelerator-type=$PSPEC_TPU_TYPE" "--version=$PSPEC_TPU_RUNTIME" "${spot[@]}" "${ARGS[@]}"
fi
