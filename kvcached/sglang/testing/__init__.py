"""Test and demo scaffolding for kvcached under SGLang; a server never imports it."""
