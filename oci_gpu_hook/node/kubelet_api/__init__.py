"""The kubelet's device plugin API (v1beta1): deviceplugin.proto and the modules generated from it
by scripts/generate-kubelet-stubs.sh (`make stubs`). Only node/plugin/api.py imports them."""
