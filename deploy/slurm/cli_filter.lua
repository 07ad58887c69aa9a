-- gpumem's client-side hook (CliFilterPlugins=cli_filter/lua): a batch job that states its
-- model in #GPUMEM lines or a `gpumem:` comment gets the gres/shard count, GPU-type feature and
-- comment `gpumem slurm request` sizes for it, before sbatch sends it. Here gpumem may trace a
-- PyTorch model (on the login node, as the user); the comment then carries the estimate, which
-- job_submit.lua on the controller reads instead of tracing. A job gpumem cannot size or place
-- is refused here with the reason; a job without directives is not touched.
local gpumem = dofile(string.match(debug.getinfo(1, "S").source, "^@(.*/)") .. "gpumem.lua")

function slurm_cli_setup_defaults(options, early)
  return slurm.SUCCESS
end

local function read(path)
  local f = path and io.open(path, "r")
  if not f then return nil end
  local text = f:read("*a")
  f:close()
  return text
end

function slurm_cli_pre_submit(options, offset)
  -- One heterogeneous job's components share a script: size it once, for the first.
  if offset ~= 0 then return slurm.SUCCESS end
  -- sbatch's script (nil when it comes on standard input: then only the comment can state it).
  local script_path = options.type == "sbatch" and options.argv[1] or nil
  if not gpumem.states_a_model(read(script_path), options.comment) then return slurm.SUCCESS end
  local answer, reason = gpumem.request({
    script = script_path, comment = options.comment, gres = options.gres, constraint = options.constraint,
    chdir = options.chdir,
  })
  if not answer then
    slurm.log_error("%s", reason)
    return slurm.ERROR
  end
  if answer.gres then options.gres = answer.gres end
  if answer.constraint then options.constraint = answer.constraint end
  if answer.comment then options.comment = answer.comment end
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, jobid, stepid)
  return slurm.SUCCESS
end
