"""Typed models, one module per domain, shared by the API, the workflows and the activities.

The layers are one-way: api -> workflows -> activities -> building blocks (models, ragline, temporal).
A model lives here when more than one layer uses it; nothing here does I/O.
"""
