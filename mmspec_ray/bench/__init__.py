"""mmspec_ray.bench"""
