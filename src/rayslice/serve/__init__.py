"""Serving on slices: Ray Serve deployments whose replicas each own one whole slice.

Example:
    >>> from rayslice import serve as slice_serve
    >>> slice_serve.SliceServeConfig("TPU-V4", "2x2x2").topology_info.num_hosts
    2
"""

from rayslice.serve.builder import app, build
from rayslice.serve.deployment import SliceServeConfig, deployment, start_http
from rayslice.serve.schema import InputSpec, RequestError

__all__ = ["InputSpec", "RequestError", "SliceServeConfig", "app", "build", "deployment", "start_http"]
