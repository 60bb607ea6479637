set -u
T0=$(date +%s)
source .devcarry/one/install.sh 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled GLM_RAY_CACHE=/tmp/glmcache
echo "installed t=$(( $(date +%s) - T0 ))"
timeout 150 python3 -m glm_ray.cli serve --device cuda --port 8000 > /tmp/serve.log 2>&1 &
for i in $(seq 1 70); do curl -sf 127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
echo "ready t=$(( $(date +%s) - T0 ))"
M=$(curl -s 127.0.0.1:8000/v1/models | python3 -c 'import sys, json; print(json.load(sys.stdin)["data"][0]["id"])'); echo "model $M"
curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d "{\"model\":\"$M\",\"prompt\":\"hello\",\"max_tokens\":8}" | cut -c1-300; echo
curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d '{"model":"nope","prompt":"hello"}' | cut -c1-200; echo
ray stop --force 2>&1 | tail -1
grep -E "Traceback|Error" /tmp/serve.log | head -5
echo "t=$(( $(date +%s) - T0 ))"
