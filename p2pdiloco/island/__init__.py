"""Islands: several processes (GPUs of one host, hosts of one LAN) that train one learner's
stretch together with FSDP2 and appear to the network as one learner (issue 13)."""
