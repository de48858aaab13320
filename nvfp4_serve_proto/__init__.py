"""Generated gRPC stubs of proto/ (python -m nvfp4_serve.gen_proto). Do not edit."""
