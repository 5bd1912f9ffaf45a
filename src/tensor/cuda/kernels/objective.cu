// The preference objectives on the device, so that a training step never waits for the host
// between the head's forward and its backward. Every objective reads the per-token logps only
// through three sums (chosen prompt, chosen response, rejected response), so its gradient is one
// constant per part. This is the CUDA form of the `*_sums` functions of train/objectives.rs,
// formula by formula in f64; the host later recomputes loss and metrics from the sums written here.

// Objective kinds (train::device_loss::kind; OBJ_DPO is DPO's sigmoid loss).
#define OBJ_SUMS 0
#define OBJ_ORPO_FULL 1
#define OBJ_ORPO_RESPONSE 2
#define OBJ_SFT_RESPONSE 3
#define OBJ_SFT_ALL 4
#define OBJ_DPO 5
#define OBJ_SIMPO 6
#define OBJ_DPO_IPO 7
#define OBJ_DPO_HINGE 8
#define OBJ_DPO_ROBUST 9

// objectives::LOGP_POSITIVE_TOLERANCE and ODDS_MEAN_CEILING.
#define OBJ_LOGP_TOL 1e-3
#define OBJ_ODDS_CEILING -1e-30

__device__ double obj_log_sigmoid(double x) {
    return x >= 0.0 ? -log1p(exp(-x)) : x - log1p(exp(x));
}

__device__ double obj_sigmoid(double x) {
    if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
    const double e = exp(x);
    return e / (1.0 + e);
}

// log(1 - exp(x)) for x < 0 (Mächler's recipe), and its derivative -1 / expm1(-x).
__device__ double obj_log1mexp(double x) {
    return x > -0.6931471805599453 ? log(-expm1(x)) : log1p(-exp(x));
}

__device__ double obj_d_log1mexp(double x) { return -1.0 / expm1(-x); }

// The loss, and d loss / d logp per part in c, from the part sums s and counts n (kinds as
// above): objectives::{orpo,sft,dpo,simpo}_sums.
__device__ double obj_coefficients(int kind, const double* s, const int* n, double p0, double p1,
                                   const double* ref, double* c) {
    c[0] = c[1] = c[2] = 0.0;
    double loss = 0.0;
    switch (kind) {
    case OBJ_ORPO_FULL:
    case OBJ_ORPO_RESPONSE: {
        const double lambda = p0, nc = n[1], nr = n[2];
        const double lw = fmin(s[1] / nc, OBJ_ODDS_CEILING), lr = fmin(s[2] / nr, OBJ_ODDS_CEILING);
        const double log_odds = (lw - lr) - (obj_log1mexp(lw) - obj_log1mexp(lr));
        const double d_or = -obj_sigmoid(-log_odds);
        const double d_lw = lambda * d_or * (1.0 - obj_d_log1mexp(lw));
        const double d_lr = lambda * d_or * (-1.0 + obj_d_log1mexp(lr));
        double nll, nll_prompt, nll_resp;
        if (kind == OBJ_ORPO_FULL) {
            const double all = (double)(n[0] + n[1]);
            nll = -(s[0] + s[1]) / all;
            nll_prompt = -1.0 / all;
            nll_resp = -1.0 / all;
        } else {
            nll = -(s[1] / nc);
            nll_prompt = 0.0;
            nll_resp = -1.0 / nc;
        }
        loss = nll + lambda * -obj_log_sigmoid(log_odds);
        c[0] = nll_prompt;
        c[1] = d_lw / nc + nll_resp;
        c[2] = d_lr / nr;
        break;
    }
    case OBJ_SFT_RESPONSE:
        loss = -(s[1] / (double)n[1]);
        c[1] = -1.0 / (double)n[1];
        break;
    case OBJ_SFT_ALL:
        loss = -(s[0] + s[1]) / (double)(n[0] + n[1]);
        c[0] = c[1] = -1.0 / (double)(n[0] + n[1]);
        break;
    case OBJ_DPO:
    case OBJ_DPO_IPO:
    case OBJ_DPO_HINGE:
    case OBJ_DPO_ROBUST: {
        const double beta = p0, ls = p1, nc = n[1], nr = n[2];
        // IPO's margin is on token means (TRL); tc, tr: what one token moves each logp by.
        const bool ipo = kind == OBJ_DPO_IPO;
        const double pc = ipo ? s[1] / nc : s[1], pr = ipo ? s[2] / nr : s[2];
        const double rc = ipo ? ref[1] / nc : ref[1], rr = ipo ? ref[2] / nr : ref[2];
        const double tc = ipo ? 1.0 / nc : 1.0, tr = ipo ? 1.0 / nr : 1.0;
        const double z = (pc - rc) - (pr - rr), u = beta * z;
        double dz;
        if (kind == OBJ_DPO) {
            loss = -(1.0 - ls) * obj_log_sigmoid(u) - ls * obj_log_sigmoid(-u);
            dz = beta * (-(1.0 - ls) * obj_sigmoid(-u) + ls * obj_sigmoid(u));
        } else if (kind == OBJ_DPO_ROBUST) {
            const double k = 1.0 - 2.0 * ls;
            loss = (-(1.0 - ls) * obj_log_sigmoid(u) + ls * obj_log_sigmoid(-u)) / k;
            dz = beta * (-(1.0 - ls) * obj_sigmoid(-u) - ls * obj_sigmoid(u)) / k;
        } else if (kind == OBJ_DPO_HINGE) {
            const double h = 1.0 - u;
            loss = h > 0.0 ? h : 0.0;
            dz = h > 0.0 ? -beta : 0.0;
        } else {
            const double d = z - 1.0 / (2.0 * beta);
            loss = d * d;
            dz = 2.0 * d;
        }
        c[1] = dz * tc;
        c[2] = -dz * tr;
        break;
    }
    case OBJ_SIMPO: {
        const double beta = p0, gamma = p1;
        const double z = beta * (s[1] / n[1] - s[2] / n[2]) - gamma;
        const double dz = -obj_sigmoid(-z);
        loss = -obj_log_sigmoid(z);
        c[1] = beta * dz / n[1];
        c[2] = -beta * dz / n[2];
        break;
    }
    default:
        break;
    }
    return loss;
}

// One block. Part p covers logp[start_p, start_p + len_p). stats: sums [0..3], first bad token
// (non-finite or above the tolerance; -1 if none) [3], its value [4], coefficients [5..8], 1 if the
// loss was clipped [8]. A bad token zeroes every coefficient; the host reports it when it reads the
// stats. clip > 0: a loss above it has zero gradient (SumsOut::clip); clip <= 0: no clip. weight:
// the step's weight times the example's.
extern "C" __global__ void lf_obj_pair(const float* logp, int s0, int n0, int s1, int n1, int s2, int n2,
                                       int kind, double p0, double p1, const double* ref, double clip, float weight,
                                       double* stats, float* dlogp) {
    const int start[3] = {s0, s1, s2}, len[3] = {n0, n1, n2};
    __shared__ double red[3][32];
    __shared__ double coef[3];
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0x7fffffff;
    __syncthreads();
    double acc[3] = {0.0, 0.0, 0.0};
    #pragma unroll
    for (int p = 0; p < 3; ++p) {
        for (int i = threadIdx.x; i < len[p]; i += blockDim.x) {
            const double x = (double)logp[start[p] + i];
            if (!(isfinite(x) && x <= OBJ_LOGP_TOL)) atomicMin(&bad, start[p] + i);
            acc[p] += x;
        }
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    #pragma unroll
    for (int p = 0; p < 3; ++p) {
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[p] += __shfl_xor_sync(0xffffffffu, acc[p], o);
        if (lane == 0) red[p][w] = acc[p];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double s[3];
        for (int p = 0; p < 3; ++p) {
            s[p] = 0.0;
            for (int k = 0; k < (int)(blockDim.x >> 5); ++k) s[p] += red[p][k];
            stats[p] = s[p];
        }
        double c[3] = {0.0, 0.0, 0.0};
        stats[8] = 0.0;
        if (bad == 0x7fffffff) {
            const double loss = obj_coefficients(kind, s, len, p0, p1, ref, c);
            if (clip > 0.0 && loss > clip) {
                c[0] = c[1] = c[2] = 0.0;
                stats[8] = 1.0;
            }
            stats[3] = -1.0;
            stats[4] = 0.0;
        } else {
            stats[3] = (double)bad;
            stats[4] = (double)logp[bad];
        }
        for (int p = 0; p < 3; ++p) {
            coef[p] = c[p];
            stats[5 + p] = c[p];
        }
    }
    __syncthreads();
    #pragma unroll
    for (int p = 0; p < 3; ++p) {
        const float g = (float)coef[p] * weight;
        for (int i = threadIdx.x; i < len[p]; i += blockDim.x) dlogp[start[p] + i] = g;
    }
}
