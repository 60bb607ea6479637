"""`build_app(args)`: the Serve application (OpenAI ingress -> Router), for `serve run`,
`serve build`, `serve deploy` and `glm-ray serve`.

    serve run glm_ray.serve.app:build_app model=/models/GLM-5 tp=8
    # or, in a serve config: import_path: glm_ray.serve.app:build_app, args: {model: ..., tp: 8}
"""
from __future__ import annotations

from ray.serve import Application

from glm_ray.serve.args import ServeArgs
from glm_ray.serve.ingress import ingress_deployment
from glm_ray.serve.router import router_deployment


def build_app(args: dict | None = None) -> Application:
    a = ServeArgs.from_dict(args)
    model = a.resolved_model()
    router = router_deployment(a).bind(a.to_dict())
    # NOTE: long generations must survive rolling updates: both deployments drain for up to 10 minutes
    ingress = ingress_deployment(num_replicas=a.ingress_replicas, ray_actor_options={"num_cpus": 0.1},
                                 graceful_shutdown_timeout_s=600)
    return ingress.bind(router, model, a.model_name(), api_key=a.api_key,
                        trust_request_chat_template=a.trust_request_chat_template,
                        tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser)
