-- Slurm cli_filter (Lua) for Locus: a job that names its dataset is steered to nodes
-- that already hold it.
--
--   sbatch --comment=dataset:imagenet@3 train.sh        (or LOCUS_DATASET=imagenet@3)
--
-- becomes `--prefer=locus_imagenet_3`: Slurm prefers nodes with that feature (set by
-- `locus slurm features`, run from cron or a systemd timer) and falls back to any node
-- when too few have it. Several datasets: dataset:a@1,b@2 → --prefer=locus_a_1&locus_b_2.
-- Install as cli_filter.lua next to slurm.conf and set CliFilterPlugins=cli_filter/lua.

local function feature(ref)
  local name, version = string.match(ref, "^%s*([%w%._%-]+)@(%d+)%s*$")
  if not name then
    return nil
  end
  return "locus_" .. string.gsub(name, "[^%w]", "_") .. "_" .. version
end

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  local spec = os.getenv("LOCUS_DATASET")
  local comment = options["comment"]
  if (spec == nil or spec == "") and comment ~= nil then
    spec = string.match(comment, "dataset:([^%s]+)")
  end
  if spec == nil or spec == "" then
    return slurm.SUCCESS
  end
  local wanted = {}
  for ref in string.gmatch(spec, "[^,]+") do
    local f = feature(ref)
    if f == nil then
      slurm.log_error("locus: %s is not DATASET@VERSION; not steering this job", ref)
      return slurm.SUCCESS
    end
    table.insert(wanted, f)
  end
  -- Never override what the user asked for explicitly.
  if options["prefer"] == nil or options["prefer"] == "" then
    options["prefer"] = table.concat(wanted, "&")
  end
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, jobid, stepid)
  return slurm.SUCCESS
end
