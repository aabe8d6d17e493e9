import csv,sys,re
from collections import Counter,defaultdict
rows=list(csv.reader(open(sys.argv[1])))
h=rows[1]; data=rows[2:]
ix={k:i for i,k in enumerate(h)}
S=ix["Warp Stall Sampling (All Samples)"]
stall_cols=[k for k in h if k.startswith("stall_") and "Not Issued" not in k]
tot=0; byop=Counter(); reasons=Counter(); top=[]
for r in data:
    if len(r)<len(h): continue
    try: s=float(r[S] or 0)
    except: continue
    tot+=s
    op=r[ix["Source"]].strip().split()
    op=[o for o in op if not o.startswith("@")]
    name=op[0] if op else "?"
    byop[name.split(".")[0]]+=s
    for k in stall_cols:
        try: reasons[k]+=float(r[ix[k]] or 0)
        except: pass
    top.append((s,r[ix["Address"]],r[ix["Source"]][:90],{k:r[ix[k]] for k in stall_cols if r[ix[k]] not in ("","0")}))
print("total samples",tot)
print("by op", [(k,round(100*v/tot,1)) for k,v in byop.most_common(14)])
print("reasons", [(k,round(100*v/tot,1)) for k,v in reasons.most_common(10)])
for s,a,src,st in sorted(top,reverse=True)[:25]:
    print(f"{100*s/tot:5.1f}% {a} {src} {st}")
