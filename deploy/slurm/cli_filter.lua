-- Slurm cli_filter (Lua) for Locus: a job that names its dataset is steered to nodes
-- that already hold it.
--
--   sbatch --comment=dataset:imagenet@3 train.sh        (or LOCUS_DATASET=imagenet@3)
--
-- becomes `--prefer=locus_imagenet_3`: Slurm prefers nodes with that feature (set by
-- `locus slurm features`, run from cron or a systemd timer) and falls back to any node
-- when too few have it. Several datasets: dataset:a@1,b@2 → --prefer=locus_a_1&locus_b_2.
-- Install as cli_filter.lua next to slurm.conf and set CliFilterPlugins=cli_filter/lua.
--
-- Slurm refuses a job whose --prefer names a feature no node has ("Invalid preferred
-- feature specification"), which is the case for a dataset no node holds yet, and for
-- every dataset after `scontrol reconfigure` until the next feature sync. So only
-- features some node has now (sinfo) are preferred; the rest are dropped, and a job
-- none of whose datasets is anywhere runs with no preference at all.

local function feature(ref)
  local name, version = string.match(ref, "^%s*([%w%._%-]+)@(%d+)%s*$")
  if not name then
    return nil
  end
  return "locus_" .. string.gsub(name, "[^%w]", "_") .. "_" .. version
end

-- The features some node of the cluster has now, as a set; nil when sinfo fails.
local function features_present()
  local p = io.popen("sinfo -h -N -o %f 2>/dev/null; echo \"rc=$?\"")
  if p == nil then
    return nil
  end
  local out = p:read("*a")
  p:close()
  -- Lua 5.1 (what Slurm links) gives no exit status from close(): the shell prints it.
  if not string.match(out, "rc=0%s*$") then
    slurm.log_error("locus: sinfo failed; not steering this job")
    return nil
  end
  local set = {}
  for f in string.gmatch(out, "[^%s,]+") do
    set[f] = true
  end
  return set
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
  if options["prefer"] ~= nil and options["prefer"] ~= "" then
    return slurm.SUCCESS
  end
  local present = features_present()
  if present == nil then
    return slurm.SUCCESS
  end
  local kept = {}
  for _, f in ipairs(wanted) do
    if present[f] then
      table.insert(kept, f)
    end
  end
  if #kept > 0 then
    options["prefer"] = table.concat(kept, "&")
  end
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, jobid, stepid)
  return slurm.SUCCESS
end
