"""kvquota in front of the gateways people already run: an Envoy external processor
(`kvquota gateway envoy`, ext_proc/) and a LiteLLM proxy plugin (litellm_proxy.py), both built on
kvquota.client. What they share is here: the configuration (config.py), reading and rewriting
OpenAI requests (openai_requests.py), reading the answers (openai_responses.py), tokenizing as
the engine does (tokenizing.py) and the Admit a request becomes (admission.py).

Their third-party dependencies are the `gateways` extra: `pip install 'kvquota[gateways]'`.
"""
