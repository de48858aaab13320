"""What the prefill and decode services and the router share: errors and their status tables, the gRPC server
and credentials, metrics and load, the KV layout and transfer paths, engine flags. Imports only nvfp4_kernels/, engine/,
tokenization/ and the generated protos; the torch-free modules (tls, service_auth, cli_help, model_source) stay
importable without torch, for the router."""
