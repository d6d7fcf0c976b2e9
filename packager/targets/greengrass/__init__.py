"""The Greengrass target: a component whose `Run` step starts the edge agent on each core device."""
