#!/usr/bin/env bash
# Static checks of the deployment files, no containers started:
#   - docker-compose validates deploy/docker-compose.yml with deploy/.env,
#     alone and with each override (GPU, CPU, TLS), and the CPU stack names
#     no GPU;
#   - promtool validates deploy/prometheus/prometheus.yml, and parses every
#     dashboard expression (variables filled in) as a recording rule;
#   - every dashboard is valid JSON, uses the provisioned data source, and
#     reads only metrics that docs/metrics.md lists (or DCGM_ metrics).
# Usage: check_deploy_files.sh [SOURCE_DIR]   (default: this repository)
set -uo pipefail

SOURCE_DIR=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$SOURCE_DIR"

failed=0
passed=0
check() {  # check "what" command...: runs it, prints its output on failure
  local what=$1
  shift
  local output
  if output=$("$@" 2>&1); then
    echo "ok    $what"
    passed=$((passed + 1))
  else
    echo "FAIL  $what"
    printf '%s\n' "$output" | sed 's/^/      /'
    failed=$((failed + 1))
  fi
}

missing=()
for tool in docker-compose promtool python3; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "check_deploy_files: missing ${missing[*]} (scripts/setup installs them)" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

compose_config() {  # compose_config FILE...; docker-compose only warns about a variable .env lacks
  local output files=()
  for file in "$@"; do files+=(-f "$file"); done
  output=$(docker-compose "${files[@]}" --env-file deploy/.env config -q 2>&1) \
    || { printf '%s\n' "$output"; return 1; }
  if grep -i 'variable is not set' <<<"$output"; then return 1; fi
}
check "deploy/docker-compose.yml with deploy/.env (docker-compose config)" \
  compose_config deploy/docker-compose.yml
check "deploy/docker-compose.yml + docker-compose.gpu.yml (docker-compose config)" \
  compose_config deploy/docker-compose.yml deploy/docker-compose.gpu.yml
check "deploy/docker-compose.yml + docker-compose.cpu.yml (docker-compose config)" \
  compose_config deploy/docker-compose.yml deploy/docker-compose.cpu.yml
check "deploy/docker-compose.yml + docker-compose.gpu.yml + docker-compose.tls.yml (docker-compose config)" \
  compose_config deploy/docker-compose.yml deploy/docker-compose.gpu.yml deploy/docker-compose.tls.yml
check "deploy/docker-compose.yml + docker-compose.cpu.yml + docker-compose.tls.yml (docker-compose config)" \
  compose_config deploy/docker-compose.yml deploy/docker-compose.cpu.yml deploy/docker-compose.tls.yml
# The CPU stack reserves no GPU and runs no DCGM exporter; the GPU one does.
cpu_free_of_gpus() {
  local config
  config=$(docker-compose -f deploy/docker-compose.yml -f deploy/docker-compose.cpu.yml \
    --env-file deploy/.env config 2>/dev/null) || return 1
  ! grep -qE 'nvidia|dcgm' <<<"$config"
}
check "the CPU stack (docker-compose.cpu.yml) names no GPU and no DCGM exporter" cpu_free_of_gpus
gpu_has_gpus() {
  local config
  config=$(docker-compose -f deploy/docker-compose.yml -f deploy/docker-compose.gpu.yml \
    --env-file deploy/.env config 2>/dev/null) || return 1
  grep -q 'driver: nvidia' <<<"$config" && grep -q 'dcgm-exporter:' <<<"$config"
}
check "the GPU stack (docker-compose.gpu.yml) reserves GPUs and runs the DCGM exporter" gpu_has_gpus
check "deploy/prometheus/prometheus.yml (promtool check config)" \
  promtool check config deploy/prometheus/prometheus.yml
if grep -A12 'job_name: shardtraind' deploy/prometheus/prometheus.yml | grep -q 'honor_labels: true'; then
  echo "ok    shardtraind scrape job has honor_labels: true"
  passed=$((passed + 1))
else
  echo "FAIL  the shardtraind scrape job must set honor_labels: true (docs/metrics.md says why)"
  failed=$((failed + 1))
fi

for dashboard in deploy/grafana/dashboards/*.json; do
  check "$dashboard is JSON" python3 -m json.tool "$dashboard" /dev/null
done
check "dashboards read only documented metrics and the provisioned data source" \
  python3 "$HERE/dashboards.py" check "$SOURCE_DIR"
if python3 "$HERE/dashboards.py" rules "$SOURCE_DIR" > "$tmp/dashboards.rules.json" 2> "$tmp/rules.err"; then
  # Rules are named dashboard_query_N; their `source` label names the panel.
  check "every dashboard expression parses (promtool check rules)" \
    promtool check rules "$tmp/dashboards.rules.json"
  if [[ $failed -gt 0 ]] && ! promtool check rules "$tmp/dashboards.rules.json" >/dev/null 2>&1; then
    python3 "$HERE/dashboards.py" explain "$SOURCE_DIR" \
      $(promtool check rules "$tmp/dashboards.rules.json" 2>&1 | grep -o 'dashboard_query_[0-9]*' | sort -u)
  fi
else
  echo "FAIL  could not extract the dashboard expressions"
  sed 's/^/      /' "$tmp/rules.err"
  failed=$((failed + 1))
fi

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
