// The fields of a TrainConfig by key, for the config's JSON forms (config.cc) and its
// validation (config_validate.cc). Private to src/train.
#pragma once

#include "switchyard/train/config.h"

namespace switchyard::train {

// Calls fn(key, field) for every option, in a fixed order (the JSON key order).
template <typename Config, typename Fn>
void VisitFields(Config& c, Fn&& fn) {
  fn("vocab_size", c.model.vocab_size);
  fn("seq_len", c.model.seq_len);
  fn("model_dim", c.model.model_dim);
  fn("num_layers", c.model.num_layers);
  fn("num_heads", c.model.num_heads);
  fn("hidden_dim", c.model.hidden_dim);
  fn("norm", c.model.norm);
  fn("activation", c.model.activation);
  fn("tied_head", c.model.tied_head);
  fn("moe_every", c.model.moe_every);
  fn("init_std", c.model.init_std);
  fn("num_experts", c.num_experts);
  fn("experts_per_block", c.experts_per_block);
  fn("top_k", c.top_k);
  fn("capacity_factor", c.capacity_factor);
  fn("expert_hidden_dim", c.expert_hidden_dim);
  fn("aux_loss_coef", c.aux_loss_coef);
  fn("z_loss_coef", c.z_loss_coef);
  fn("moe_layer_config", c.moe_layer_config);
  fn("check_finite", c.check_finite);
  fn("routing_scope", c.routing_scope);
  fn("num_groups", c.num_groups);
  fn("group_topk", c.group_topk);
  fn("topk_scaling_factor", c.topk_scaling_factor);
  fn("aux_loss", c.aux_loss);
  fn("expert_bias_update_rate", c.expert_bias_update_rate);
  fn("router_trace", c.router_trace);
  fn("router_trace_steps", c.router_trace_steps);
  fn("router_replay", c.router_replay);
  fn("data", c.data);
  fn("val_data", c.val_data);
  fn("val_fraction", c.val_fraction);
  fn("steps", c.steps);
  fn("batch_size", c.batch_size);
  fn("lr", c.lr);
  fn("min_lr", c.min_lr);
  fn("warmup_steps", c.warmup_steps);
  fn("weight_decay", c.weight_decay);
  fn("beta1", c.beta1);
  fn("beta2", c.beta2);
  fn("adam_eps", c.adam_eps);
  fn("grad_clip", c.grad_clip);
  fn("nonfinite", c.nonfinite);
  fn("seed", c.seed);
  fn("out", c.out);
  fn("log_every", c.log_every);
  fn("eval_every", c.eval_every);
  fn("eval_tokens", c.eval_tokens);
  fn("checkpoint_every", c.checkpoint_every);
  fn("keep_checkpoints", c.keep_checkpoints);
  fn("sample_tokens", c.sample_tokens);
  fn("temperature", c.temperature);
  fn("threads", c.threads);
  fn("trace_step", c.trace_step);
  fn("ranks", c.ranks);
  fn("ep", c.ep);
  fn("zero_stage", c.zero_stage);
  fn("overlap_grad_reduce", c.overlap_grad_reduce);
  fn("bucket_mb", c.bucket_mb);
  fn("dispatch", c.dispatch);
  fn("overlap_degree", c.overlap_degree);
  fn("adaptive_r", c.adaptive_r);
  fn("a2a_algo", c.a2a_algo);
  fn("a2a_ranks_per_node", c.a2a_ranks_per_node);
  fn("smart_schedule", c.smart_schedule);
  fn("shadow_experts", c.shadow_experts);
  fn("tp", c.tp);
  fn("sequence_parallel", c.sequence_parallel);
  fn("tp_comm_overlap", c.tp_comm_overlap);
  fn("arrangement", c.arrangement);
  fn("etp", c.etp);
  fn("cp", c.cp);
  fn("cp_algo", c.cp_algo);
  fn("attention_core", c.attention_core);
  fn("memory_budget_mib", c.memory_budget_mib);
  fn("microbatches", c.microbatches);
  fn("recompute", c.model.recompute);
  fn("precision", c.model.precision);
  fn("pp", c.pp);
  fn("pipeline_schedule", c.pipeline_schedule);
  fn("virtual_stages", c.virtual_stages);
  fn("pipeline_split", c.pipeline_split);
}

}  // namespace switchyard::train
