-- One fairness key per tenant, taken from the "tenant" header, and the tenant as the
-- message's throttle key (a rate limit applies once `fila config set throttle.<tenant>`
-- gives it one). Paying tenants ("tier" = "pro") get twice the share of delivery slots.
function on_enqueue(msg)
  local weight = 1
  if msg.headers.tier == "pro" then weight = 2 end
  local tenant = msg.headers.tenant or "anonymous"
  return { fairness_key = tenant, weight = weight, throttle_keys = { tenant } }
end
