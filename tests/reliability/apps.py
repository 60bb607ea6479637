"""The test-only Serve application of the reliability suite (no imports: tests/conftest.py and
scripts/reliability.py both deploy it).

"faults": the tiny model with a tiny KV cache (0.002 GiB = 1280 tokens of the tiny model's 1664
bytes/token in fp32, so 4x the KV capacity is a handful of requests; max_model_len follows the
capacity: min(max_position_embeddings, KV capacity)) and the test-only fault-injection hook armed
on three token ids (the workers read GLM_RAY_FAULT_INJECTION; Ray passes the app's runtime_env on
to the Router and its worker actors):
  exception@900  a step computing token 900 raises RuntimeError in the forward -> that step's requests: 500
  oom@901        ... raises torch.OutOfMemoryError                             -> that step's requests: 503
  sample@902     the sampler raises for the row of a request whose prompt holds 902 -> that request: 500
The random tiny model can *sample* these ids too: every ordinary request sent to "faults" lists
them in stop_token_ids (FAULT_TOKENS), so a sampled one ends the request instead of being computed.
"""
EXCEPTION_TOKEN, OOM_TOKEN, SAMPLE_TOKEN = 900, 901, 902
FAULT_TOKENS = [EXCEPTION_TOKEN, OOM_TOKEN, SAMPLE_TOKEN]
FAULT_SPEC = f"exception@{EXCEPTION_TOKEN},oom@{OOM_TOKEN},sample@{SAMPLE_TOKEN}"

FAULTS_APP = {
    "name": "faults", "route_prefix": "/faults",
    "args": {"served_model_name": "glm5-tiny-faults", "kv_cache_memory_gb": 0.002},
    "runtime_env": {"env_vars": {"GLM_RAY_FAULT_INJECTION": FAULT_SPEC}},
}
