-- One fairness key per tenant, taken from the "tenant" header. Paying tenants
-- ("tier" = "pro") get twice the share of delivery slots.
function on_enqueue(msg)
  local weight = 1
  if msg.headers.tier == "pro" then weight = 2 end
  return { fairness_key = msg.headers.tenant or "anonymous", weight = weight }
end
