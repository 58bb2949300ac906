import json, sys, random, statistics as st
d = json.load(open(sys.argv[1]))
rows = d["rows"]
by = {}
for x in rows:
    by[(x["arm"], x["prompt"], x["repeat"])] = x
arms = sorted({x["arm"] for x in rows})
def paired(a, b, key, kind=None):
    r = []
    for (arm, p, rep), x in by.items():
        if arm != a or (kind and x["kind"] != kind):
            continue
        y = by.get((b, p, rep))
        if y: r.append(y[key] / x[key])      # b / a : >1 means a faster
    return r
def ci(v, n=4000):
    random.seed(0)
    meds = sorted(st.median(random.choices(v, k=len(v))) for _ in range(n))
    return st.median(v), meds[int(.025*n)], meds[int(.975*n)]
for b in ["ngram:1","ngram:2","ngram:4","ngram:8","draft:4","rakvcopy","plain"]:
    for key in ("wall_s","cpu_s"):
        v = paired("rakv", b, key)
        m, lo, hi = ci(v)
        print(f"{b:9} / rakv {key}: paired median {m:.3f} [{lo:.3f}, {hi:.3f}] n={len(v)}")
print("open prompts, rakv / plain per prompt (median over repeats):")
for key in ("wall_s","cpu_s"):
    out=[]
    for p in sorted({x["prompt"] for x in rows if x["kind"]=="chat"}):
        r = [by[("rakv",p,rep)][key] for rep in (0,1) if ("rakv",p,rep) in by]
        q = [by[("plain",p,rep)][key] for rep in (0,1) if ("plain",p,rep) in by]
        out.append(round(st.median(r)/st.median(q),3))
    print(key, out)
# A/A-like: the two repeats of plain
v=[by[("plain",p,1)]["wall_s"]/by[("plain",p,0)]["wall_s"] for p in sorted({x["prompt"] for x in rows})]
print("plain r1/r0 wall", [round(x,3) for x in v])
