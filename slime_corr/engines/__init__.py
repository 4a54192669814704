"""Rollout engines, interchangeable behind one launch interface (`launch.start_engines`): the real SGLang server
(`sglang_server`, the default) and the embedded engine (`embedded`, bit-reproducible, for unit tests and runs
without sglang). Both speak SGLang's HTTP protocol; the client side (`slime_corr.rollout`) never imports this
package. Several engines go behind sglang-router (`router`, `group`)."""
