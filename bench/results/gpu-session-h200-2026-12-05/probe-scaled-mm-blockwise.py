import torch
f8=torch.float8_e4m3fn
for M in (20, 24, 40, 48, 272):
  for K,N in ((256,256),):
    a=torch.randn(M,K,device='cuda').to(f8); b=torch.randn(N,K,device='cuda').to(f8)
    for name,sa in (("outer-major",torch.rand(K//128,M,device='cuda').t()),("row-major",torch.rand(M,K//128,device='cuda'))):
      sb=torch.rand(N//128,K//128,device='cuda')
      for sbn,sbx in (("sb.t()",sb.t()),("sb",sb)):
        try:
          torch._scaled_mm(a,b.t(),scale_a=sa,scale_b=sbx,out_dtype=torch.bfloat16,use_fast_accum=False); torch.cuda.synchronize(); r="ok"
        except Exception as e: r=str(e).split('\n')[0][:90]
        print(M,name,sbn,r)
