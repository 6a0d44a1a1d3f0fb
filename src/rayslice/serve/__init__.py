"""Serving on slices: Ray Serve deployments whose replicas each own one whole slice.

LLM serving behind an OpenAI-compatible API is in :mod:`rayslice.serve.llm`
(``from rayslice.serve import llm``); it is not imported here, so plain slice
deployments do not load the model code.

Example:
    >>> from rayslice import serve as slice_serve
    >>> slice_serve.SliceServeConfig("TPU-V4", "2x2x2").topology_info.num_hosts
    2
"""

from rayslice.serve.builder import app, build
from rayslice.serve.config import SliceServeConfig, parse_accelerator_config
from rayslice.serve.deployment import DeploymentFailed, deployment, failure_reason, run, start_http
from rayslice.serve.replica import http_status
from rayslice.serve.schema import ColumnSpec, InputSpec, RequestError

__all__ = [
    "ColumnSpec",
    "DeploymentFailed",
    "InputSpec",
    "RequestError",
    "SliceServeConfig",
    "app",
    "build",
    "deployment",
    "failure_reason",
    "http_status",
    "parse_accelerator_config",
    "run",
    "start_http",
]
