"""Training runs as data.

records: run ids, records and their real state; summary: what a finished run left, read
from its log; metrics: its training curves across a resume lineage; view: every node's
runs as `runs` shows them.
"""
