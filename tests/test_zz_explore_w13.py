from test_parity import *  # noqa

def test_explore(both_ways):
    (nenv, nres, nout), (renv, rres, rout) = both_ways["native"], both_ways["rllog"]
    info = load_run_info(rres["run_dir"])[0]
    rows, cfg = wandb_rows(nenv)
    print("WB native tables", [(r.get("train/global_step"), r.get("_step"), r["completions"]) for r in rows if "completions" in r])
    print("WB native cfg", repr(cfg.get("report_to")))
    r_wb = readers.wandb.read_back(renv, info)
    print("WB rllog cfg", repr(r_wb.config.get("report_to")))
    n_tr, r_tr = trackio_run(nenv), readers.trackio.read_back(renv, info)
    print("TR cfg", repr(n_tr.config.get("report_to")), repr(r_tr.config.get("report_to")))
    print("TR steps", n_tr.metrics["train/reward"], r_tr.metrics["train/reward"])
    ml = readers.mlflow.read_back(renv, info); print("ML", repr(ml.config["report_to"]), repr(native_mlflow(nenv).config["report_to"]))
