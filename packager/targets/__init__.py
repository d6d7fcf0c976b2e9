"""Deploy targets: each one class behind the `Target` contract of `base`, found by name in its registry.

- `local/`: the embedded default, a server process on this machine (and its CRIU process snapshot).
- `aws/`: Lambda and SageMaker (GPU, Inferentia via `neuron`), their shared resources, and Terraform output.
- `greengrass/`: an AWS IoT Greengrass v2 component running the edge agent on core devices.
- `jetson`: an NVIDIA Jetson (or other edge device) running the edge agent, pushed to over its agent API.
- `ray/`: a Ray Serve application on a Ray cluster (or a KubeRay RayService with `--emit-kubernetes`).
"""
