-- Benchmark hook: fairness key and weight come from headers, so each workload
-- decides them per message ("key", "weight"); without them the defaults apply.
function on_enqueue(msg)
  return {
    fairness_key = msg.headers["key"] or "default",
    weight = tonumber(msg.headers["weight"] or "1"),
  }
end
