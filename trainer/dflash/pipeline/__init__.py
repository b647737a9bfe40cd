"""Threaded, compiled DFlash training pipeline (threads, warm-up, replicas, checkpoints)."""
