#!/usr/bin/env bash
# Google Cloud TPU VM startup script: turns a fresh TPU VM into a p2pdiloco volunteer node.
#
# NOT TESTED ON TPU: the project has had no TPU VM to run this on, and p2pdiloco's torch_xla
# path (`--device xla`) has not been exercised on real TPUs. Treat this as a starting point and
# read the serial console output on the first boot. Reports and fixes welcome.
#
# What it does, as root, on every boot (idempotent):
#   1. Python 3.11 (deadsnakes; the TPU VM image ships 3.10) and a venv in /opt/p2pdiloco/venv
#      with torch + torch_xla[tpu] pinned to the same version, and p2pdiloco (PyPI or git);
#   2. a system user `p2pdiloco` (home /var/lib/p2pdiloco) that owns the key and the states;
#   3. /etc/p2pdiloco/node.env (P2PDILOCO_* settings, --device xla) and a system-level unit
#      p2pdiloco-node.service running `p2pdiloco join` as that user;
#   4. `p2pdiloco doctor` as that user, and only if it passes: systemctl enable --now.
#
# Create a single-host TPU VM with it (settings as metadata; every key is optional):
#   gcloud compute tpus tpu-vm create my-node --zone us-central2-b \
#     --accelerator-type v4-8 --version tpu-ubuntu2204-base --tags p2pdiloco \
#     --metadata-from-file startup-script=node/tpu-vm-startup.sh \
#     --metadata p2pdiloco-model=gemma-1b,p2pdiloco-bootstrap=/ip4/203.0.113.10/tcp/31337/p2p/12D3KooW...
#   gcloud compute firewall-rules create p2pdiloco-node --direction INGRESS \
#     --allow tcp:31337-31338 --target-tags p2pdiloco       # DHT port and DHT port + 1
# Follow it:   gcloud compute tpus tpu-vm ssh my-node -- journalctl -u p2pdiloco-node -f
# On a multi-host slice every worker runs this script and becomes its own node (own key).
# Spot/preemptible VMs: the shutdown stops the unit with SIGINT (graceful save); the next boot
# resumes from the last certified state.
#
# Metadata keys (instance attributes) read, with their defaults below:
#   p2pdiloco-model, p2pdiloco-run, p2pdiloco-bootstrap, p2pdiloco-port, p2pdiloco-announce,
#   p2pdiloco-island, p2pdiloco-metrics-port, p2pdiloco-git-url, p2pdiloco-git-ref,
#   p2pdiloco-pip-spec, p2pdiloco-extra-env (extra KEY=value lines for node.env, ';'-separated).
set -euo pipefail

# ---- settings (metadata wins over these defaults) --------------------------------------------
# torch pin = the Makefile's TORCH (torch==2.13.0). torch_xla releases track torch's version:
# keep TORCH_XLA_VERSION equal to TORCH_VERSION (same major.minor at least). If torch_xla has no
# release for this torch yet, use the newest pair that both exist and keep them matched.
TORCH_VERSION="2.13.0"
TORCH_XLA_VERSION="2.13.0"
# CPU build of torch (TPU work goes through torch_xla; PyPI's default Linux torch pulls CUDA).
TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
# Where the libtpu wheels that torch_xla[tpu] needs are published.
LIBTPU_FIND_LINKS=(
  -f https://storage.googleapis.com/libtpu-releases/index.html
  -f https://storage.googleapis.com/libtpu-wheels/index.html
)
PYTHON=python3.11
PREFIX=/opt/p2pdiloco
VENV="$PREFIX/venv"
NODE_USER=p2pdiloco
NODE_HOME=/var/lib/p2pdiloco
ENV_FILE=/etc/p2pdiloco/node.env
UNIT_FILE=/etc/systemd/system/p2pdiloco-node.service

log() { echo "p2pdiloco-startup: $*" >&2; }

# An instance attribute from the metadata server, or $2 when it is not set (or off GCE).
meta() {
  local value
  if value=$(curl -fsS --max-time 5 -H "Metadata-Flavor: Google" \
      "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" 2>/dev/null); then
    printf '%s' "$value"
  else
    printf '%s' "${2-}"
  fi
}

MODEL=$(meta p2pdiloco-model gemma-12b)
RUN_ID=$(meta p2pdiloco-run "")
BOOTSTRAP=$(meta p2pdiloco-bootstrap "")
PORT=$(meta p2pdiloco-port 31337)
ANNOUNCE=$(meta p2pdiloco-announce "")
ISLAND=$(meta p2pdiloco-island "$(hostname)")
METRICS_PORT=$(meta p2pdiloco-metrics-port 9464)
# Install from git (GIT_URL, at GIT_REF) if set, else PIP_SPEC from PyPI.
GIT_URL=$(meta p2pdiloco-git-url "")
GIT_REF=$(meta p2pdiloco-git-ref main)
PIP_SPEC=$(meta p2pdiloco-pip-spec p2pdiloco)
EXTRA_ENV=$(meta p2pdiloco-extra-env "")

# No external address given: announce the VM's external IP, if it has one.
if [[ -z "$ANNOUNCE" ]]; then
  external_ip=$(curl -fsS --max-time 5 -H "Metadata-Flavor: Google" \
    "http://metadata.google.internal/computeMetadata/v1/instance/network-interfaces/0/access-configs/0/external-ip" \
    2>/dev/null || true)
  if [[ -n "$external_ip" ]]; then
    ANNOUNCE="/ip4/$external_ip/tcp/$PORT"
  fi
fi

# ---- 1. system packages and Python 3.11 ------------------------------------------------------
export DEBIAN_FRONTEND=noninteractive
APT=(apt-get -o DPkg::Lock::Timeout=600 -y)   # first boot: unattended-upgrades holds the lock
if ! command -v "$PYTHON" >/dev/null || ! "$PYTHON" -c "import venv, ensurepip" 2>/dev/null; then
  log "installing $PYTHON"
  "${APT[@]}" update
  "${APT[@]}" install --no-install-recommends software-properties-common ca-certificates curl
  add-apt-repository -y ppa:deadsnakes/ppa
  "${APT[@]}" update
  "${APT[@]}" install --no-install-recommends \
    "$PYTHON" "$PYTHON-venv" "$PYTHON-dev" build-essential libgmp-dev git
fi

# ---- 2. the service user ---------------------------------------------------------------------
if ! id "$NODE_USER" >/dev/null 2>&1; then
  log "creating user $NODE_USER"
  useradd --system --create-home --home-dir "$NODE_HOME" --shell /usr/sbin/nologin "$NODE_USER"
fi
install -d -o "$NODE_USER" -g "$NODE_USER" -m 0700 "$NODE_HOME" "$NODE_HOME/data" "$NODE_HOME/cache"
# TPU device nodes: let the user open them through their group (when they have one).
for dev in /dev/accel* /dev/vfio/*; do
  [[ -e "$dev" ]] || continue
  group=$(stat -c %G "$dev")
  if [[ "$group" != root ]]; then
    usermod -aG "$group" "$NODE_USER"
  fi
done

# ---- 3. the virtual environment --------------------------------------------------------------
if [[ -n "$GIT_URL" ]]; then
  SOURCE="git+$GIT_URL@$GIT_REF"
else
  SOURCE="$PIP_SPEC"
fi
STAMP="$VENV/.p2pdiloco-installed"
WANT="torch==$TORCH_VERSION torch_xla==$TORCH_XLA_VERSION $SOURCE"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
  log "installing $WANT into $VENV"
  install -d -m 0755 "$PREFIX"
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip setuptools wheel
  "$VENV/bin/pip" install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
  # The constraint keeps the torch above: nothing installed after it may replace it.
  echo "torch==$TORCH_VERSION" >"$PREFIX/constraints.txt"
  "$VENV/bin/pip" install --constraint "$PREFIX/constraints.txt" \
    "torch_xla[tpu]==$TORCH_XLA_VERSION" "${LIBTPU_FIND_LINKS[@]}"
  "$VENV/bin/pip" install --constraint "$PREFIX/constraints.txt" --upgrade "$SOURCE"
  printf '%s' "$WANT" >"$STAMP"
fi
"$VENV/bin/p2pdiloco" --version

# ---- 4. settings and the unit ----------------------------------------------------------------
# Rewritten on every boot from the metadata above: change settings there, not in this file.
# Plain KEY=value lines, as systemd's EnvironmentFile reads them (a value may hold spaces).
setting() { if [[ -n "$2" ]]; then printf '%s=%s\n' "$1" "$2"; fi; }
install -d -m 0755 /etc/p2pdiloco
umask 077
{
  echo "# Written by tpu-vm-startup.sh on $(date -u +%FT%TZ); edits are lost at the next boot."
  setting P2PDILOCO_MODEL "$MODEL"
  setting P2PDILOCO_RUN "$RUN_ID"
  setting P2PDILOCO_BOOTSTRAP "$BOOTSTRAP"
  echo "P2PDILOCO_HOST=0.0.0.0"
  echo "P2PDILOCO_PORT=$PORT"
  setting P2PDILOCO_ANNOUNCE "$ANNOUNCE"
  setting P2PDILOCO_ISLAND "$ISLAND"
  echo "P2PDILOCO_DEVICE=xla"
  echo "P2PDILOCO_METRICS_PORT=$METRICS_PORT"
  echo "P2PDILOCO_CACHE_DIR=$NODE_HOME/cache"
  echo "XDG_DATA_HOME=$NODE_HOME/data"
  echo "HF_HOME=$NODE_HOME/cache/huggingface"
  echo "PJRT_DEVICE=TPU"
  if [[ -n "$EXTRA_ENV" ]]; then
    tr ';' '\n' <<<"$EXTRA_ENV"
  fi
} >"$ENV_FILE.new"
chown root:"$NODE_USER" "$ENV_FILE.new"
chmod 0640 "$ENV_FILE.new"
mv "$ENV_FILE.new" "$ENV_FILE"
umask 022

cat >"$UNIT_FILE" <<EOF
# Written by tpu-vm-startup.sh; rewritten at every boot.
[Unit]
Description=p2pdiloco volunteer node on TPU (p2pdiloco join --device xla)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User=$NODE_USER
Group=$NODE_USER
WorkingDirectory=$NODE_HOME
EnvironmentFile=$ENV_FILE
ExecStart=$VENV/bin/p2pdiloco join --no-tui --json-logs --device xla --model \${P2PDILOCO_MODEL}
# First SIGINT: graceful stop, the state is saved, exit 0 (the next boot resumes from it).
KillSignal=SIGINT
KillMode=mixed
TimeoutStopSec=120
Restart=on-failure
RestartSec=30
NoNewPrivileges=yes
UMask=0077
LimitNOFILE=65536
# libtpu pins host memory for DMA (VFIO on v5e and later).
LimitMEMLOCK=infinity

[Install]
WantedBy=multi-user.target
EOF
systemctl daemon-reload

# ---- 5. preflight, then start ----------------------------------------------------------------
# doctor checks the device, the memory the model needs, the ports and the bootstrap servers.
# systemd-run gives it the unit's user, environment file and limits; the unit starts only if it
# passes.
systemctl stop p2pdiloco-node.service 2>/dev/null || true   # doctor needs the TPU to itself
log "running p2pdiloco doctor --model $MODEL"
if ! systemd-run --quiet --wait --pipe --collect --unit p2pdiloco-doctor \
    -p User="$NODE_USER" -p Group="$NODE_USER" -p WorkingDirectory="$NODE_HOME" \
    -p EnvironmentFile="$ENV_FILE" -p LimitMEMLOCK=infinity \
    "$VENV/bin/p2pdiloco" doctor --model "$MODEL" --device xla; then
  log "doctor failed: not starting the node. Fix the above (often: pick the model doctor"
  log "suggests via the p2pdiloco-model metadata key), then reboot or re-run this script."
  exit 1
fi
systemctl enable --now p2pdiloco-node.service
log "started: journalctl -u p2pdiloco-node -f"
