"""The Endpoint Picker: the gateway's routing behind an Envoy ext_proc gRPC server (Gateway API
Inference Extension's endpoint picker protocol v1) instead of the HTTP front end."""
