"""Operating the stack: local servers, deployments, Ray job submission, gc, environment."""
