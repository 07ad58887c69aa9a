-- gpumem's controller-side hook (JobSubmitPlugins=lua): enforces what cli_filter.lua does on
-- clients, for jobs submitted without it. It never traces: a native model is sized directly,
-- a PyTorch model by the estimate in its comment (written by cli_filter.lua or `gpumem slurm
-- request`); a job gpumem cannot place is rejected with the reason, a job without directives
-- is not touched. A job cli_filter.lua already sized is decided again to the same request.
local gpumem = dofile(string.match(debug.getinfo(1, "S").source, "^@(.*/)") .. "gpumem.lua")

function slurm_job_submit(job_desc, part_list, submit_uid)
  if not gpumem.states_a_model(job_desc.script, job_desc.comment) then return slurm.SUCCESS end
  local script_path = nil
  if job_desc.script then
    script_path = os.tmpname()
    local f = io.open(script_path, "w")
    f:write(job_desc.script)
    f:close()
  end
  local answer, reason = gpumem.request({
    script = script_path, comment = job_desc.comment, gres = job_desc.tres_per_node,
    constraint = job_desc.features, no_trace = true,
  })
  if script_path then os.remove(script_path) end
  if not answer then
    slurm.log_user("%s", reason)
    return slurm.ERROR
  end
  -- `gres` takes Slurm's request syntax and writes tres_per_node ("gres:shard:4").
  if answer.gres then job_desc.gres = answer.gres end
  if answer.constraint then job_desc.features = answer.constraint end
  if answer.comment then job_desc.comment = answer.comment end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
