"""The kubelet PodResources API (v1): the published proto, its generated Python stubs, and a client.

`api.proto` is Kubernetes' own file (see its header); `api_pb2*.py` are generated from it
(`generate.py`). `client.py` asks the kubelet which devices each container holds."""
